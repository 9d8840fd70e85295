"""`inflight plan` and `inflight profile`: a discrete-event simulator of pipelined vs sync RL (sim.py) driven by a
hardware profile (profile.py) measured on a machine (measure.py) or built from public figures (profiles/)."""
