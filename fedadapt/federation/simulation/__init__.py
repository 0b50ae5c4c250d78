"""How a simulation runs: on Flower's simulation engine with Ray (launch) or in this process
(inprocess), on which Ray cluster (cluster), with how many workers and clients per worker
(sizing), and on which simulated devices and clock (fleet)."""
