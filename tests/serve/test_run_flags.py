"""The run flags are defined once (serve/jobs/run_flags.py) and every command takes them the same way."""

import subprocess
import sys
import textwrap

from serve.server import default_model_name
from tests.conftest import ROOT


def test_one_definition_serves_every_command_and_flags_override_the_config():
  """In one process (as the tests import them): generate, the server, evaluate and calibrate define no flag twice;
  an explicit flag overrides the config file's field, an absent one keeps it, and the server's own settings fall
  back to its defaults."""
  code = textwrap.dedent("""
      import json, sys
      from absl import flags
      from serve import generate, server, evaluate, calibrate
      server.define_flags()
      flags.FLAGS(["prog", "--method=ngram", "--num_speculative_tokens=3", "--batch_size=5", "--port=9123"])
      g, s = generate.settings(), server.settings()
      print(json.dumps({"g": [g["spec"].method, g["spec"].k, g["batch_size"], g["temperature"]],
                        "s": [s["spec"].method, s["spec"].k, s["port"], s["max_queue"],
                              s["served_model_name"], s["mesh"]]}))
  """)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  import json
  got = json.loads(out.stdout.strip().splitlines()[-1])
  from configs.gemma3_270m import get_config
  cfg = get_config()
  assert got["g"] == ["ngram", 3, 5, cfg.temperature]
  assert got["s"] == ["ngram", 3, 9123, 64, "gemma-3-270m", cfg.get("mesh", "")]


def test_the_served_model_name_defaults_to_the_checkpoints_name():
  assert default_model_name("") == "gemma-3-270m"
  assert default_model_name("/models/qwen2.5-coder-0.5b-instruct-q8_0.gguf") == "qwen2.5-coder-0.5b-instruct-q8_0"
  assert default_model_name("/models/Qwen2.5-Coder-1.5B-Instruct/") == "Qwen2.5-Coder-1.5B-Instruct"


def test_every_command_flag_is_a_row_of_the_flag_table():
  """No command defines a flag itself: serve/, train/ and the maintained benchmarks take rows of
  spec_jax/flag_table.py (the one-question scripts in benchmarks/probes/ are exempt), and every row a command names
  exists (define() raises on an unknown name at import)."""
  import pathlib
  import re
  root = pathlib.Path(ROOT)
  files = [p for d in ("serve", "train", "spec_jax") for p in (root / d).rglob("*.py")] + \
      list((root / "benchmarks").glob("*.py"))
  own = [f"{p.relative_to(root)}: {m.group(0)}" for p in files if p.name != "flag_table.py"
         for m in re.finditer(r"flags\.DEFINE_\w+\(\s*\"\w+\"|DEFINE_config_file\(", p.read_text())]
  assert own == [], own
  from spec_jax import flag_table
  from spec_jax.spec_config import ENTRY_KEYS
  # the speculative config's keys are flags, under one name each
  assert {flag_table.SPEC_FLAG_NAMES.get(k, k) for k in ENTRY_KEYS} <= set(flag_table.SPEC_ROWS)


def test_the_readme_published_head_command_parses():
  """README's one command for a published EAGLE-3 head: its flags are the server's, and they mean what it says."""
  import json
  import pathlib
  import re
  import shlex
  text = (pathlib.Path(ROOT) / "README.md").read_text()
  block = re.search(r"```bash\n(?:pip install[^\n]*\n)(python -m serve\.server .*?)\n```", text, re.S)
  assert block, "README lost its published-head command"
  argv = shlex.split(block.group(1).replace("\\\n", " "))
  assert argv[:3] == ["python", "-m", "serve.server"]
  code = textwrap.dedent(f"""
      import json
      from absl import flags
      from serve import server
      server.define_flags()
      flags.FLAGS(["prog", *{argv[3:]!r}])
      s = server.settings()
      print(json.dumps([s["model"], s["costs_file"], s["port"], s["spec"].method, s["spec"].k, s["spec"].model]))
  """)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got == ["/models/Llama-3.1-8B-Instruct", "", 8000, "eagle3", 4, "/models/EAGLE3-LLaMA3.1-Instruct-8B"]
