"""Running a federation on Flower, in rooms that import only the rooms above them in this list:

* :mod:`~fedadapt.federation.wire`: what travels (per-client records in one message, the grid a
  strategy sees, the audit of what leaves a device);
* :mod:`~fedadapt.federation.server`: the server's side (the round loop, checkpoints, clean
  stops, failing clients, the original model's phase);
* :mod:`~fedadapt.federation.client`: the clients' side (a worker, grouped and one-client
  training, ClientApp mods);
* :mod:`~fedadapt.federation.simulation`: how a simulation runs (Flower's engine on Ray or in
  this process, the Ray cluster, workers and clients per worker, simulated devices).
"""
