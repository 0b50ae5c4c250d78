"""The ``plugin`` family: a module trained once on the server from the training clients' cached
features and delivered to every client for inference (ICIIA).

- :mod:`fedadapt.methods.plugin.iciia`: the inter-image attention module (the method);
- :mod:`fedadapt.methods.plugin.train`: Algorithm 1 on the server, the baselines, the clients'
  recognition;
- :mod:`fedadapt.methods.plugin.run`: the run (train, deliver in one round, summarize).
"""

from __future__ import annotations

from fedadapt.methods import Family, register_family
from fedadapt.methods.plugin import iciia  # noqa: F401  (registers method=iciia)


def _recognize(spec, msg, context):
    from fedadapt.methods.plugin.run import recognize

    return recognize(spec, msg, context)


class Plugin(Family):
    name = "plugin"
    handlers = {("evaluate", "plugin"): _recognize}

    def prepare(self, cfg, prep, *, backbone, images, original) -> None:
        from fedadapt.methods.server_trained import prepare_fields

        prepare_fields(cfg, prep, backbone=backbone, images=images, original=original)

    def run(self, cfg, run_dir, prep, **kw) -> dict:
        from fedadapt.methods.plugin.run import run_plugin

        return run_plugin(cfg, run_dir, prep, **kw)


register_family(Plugin())
