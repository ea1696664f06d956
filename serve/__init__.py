"""The jobs run over the spec_jax library, one folder each; this folder's own files are the commands users type.

  server.py      python -m serve.server      the OpenAI-compatible server (serve/http over serve/engine)
  generate.py    python -m serve.generate    batch generation, baseline against speculative (the main job)
  evaluate.py    python -m serve.evaluate    the same on a device mesh, one process per host
  calibrate.py   python -m serve.calibrate   measures per-step costs for the adaptive draft length
  check_pair.py  python -m serve.check_pair  checks a target/proposer pair before serving it
  aot.py         python -m serve.aot         compiles every program for chips this host lacks (serve/compiler)
  loadtest/      python -m serve.loadtest    the load matrix: keep speculation or roll it back
  many_hosts/                                 serve.server on many hosts: process 0 leads, the others mirror it

Imports go one way (tests/test_serve_layout.py): the commands may import any folder; http -> engine; compiler -> jobs;
loadtest -> engine, jobs; every folder -> spec_jax. engine, jobs and many_hosts import no other serve folder.
"""
