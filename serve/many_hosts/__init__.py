"""The server on many hosts (python -m serve.server, once per host): process 0 runs HTTP and the engine and sends
every slot-table call to the other processes, which replay it (multihost.py), over a TCP channel with heartbeats
and watchdogs that stop every host when one dies (multihost_channel.py). Imports only spec_jax.
"""
