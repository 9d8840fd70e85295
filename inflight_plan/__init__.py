"""`inflight plan` and `inflight profile`: a discrete-event simulator of pipelined vs sync RL (sim.py) driven by a
hardware profile (profile.py) measured on a machine (measure.py) or built from public figures (profiles/).

A package beside `inflight`: it imports from inflight (the simulator only its config; the profiler drives the engine,
trainer, actor and a launcher's server), and nothing in inflight imports it; inflight/cli.py names its two commands by
module path."""
