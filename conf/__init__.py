"""fedadapt's Hydra configuration (installed as ``fedadapt.conf``; Hydra reads it as
``pkg://fedadapt.conf``). Only YAML lives here; this file makes the folder a regular package so
that ``importlib.resources`` and Hydra find it the same way in an editable install and a wheel."""
