"""The clients' side: what a worker does with the clients a message names (worker), K clients
trained side by side on one backbone (grouped; its parts group_jobs, group_optim, group_forms,
group_vmap), the one training and evaluation loop and the run's spec (training), and Flower's
ClientApp mods around each client (mods)."""
