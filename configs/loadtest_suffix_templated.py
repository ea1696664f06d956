"""The suffix arm of the load matrix on templated traffic (issue 30): configs/loadtest_suffix.py's arms and loads
on one instruction format over different inputs (benchmarks/suffix.py's templated kind, written as a prompt file by
benchmarks/probes/templated_prompts.py from the held-apart questions), greedy, ~6 minutes:
  python -m serve.loadtest --config=configs/loadtest_suffix_templated.py"""

from configs import loadtest_suffix


def get_config():
  c = loadtest_suffix.get_config()
  # "" = a fresh folder under the working directory; the committed report:
  #   --output_dir=benchmarks/reports/gemma3_270m_suffix/templated
  c.output_dir = ""
  c.prompts = "benchmarks/reports/gemma3_270m_suffix/templated_prompts.jsonl"
  c.prompt_split = ""  # the file is made from the held-apart half already
  c.samplings = ({"name": "greedy", "temperature": 0.0, "top_p": 1.0},)
  c.requests_per_point = 8
  return c
