"""The run flags are defined once (serve/run_flags.py) and every command takes them the same way."""

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
      print(json.dumps({"g": [g["method"], g["num_speculative_tokens"], g["batch_size"], g["temperature"]],
                        "s": [s["method"], s["num_speculative_tokens"], s["port"], s["max_queue"],
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
