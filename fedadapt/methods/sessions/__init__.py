"""The ``sessions`` family: a generator trained once on the server that answers every session of
every client with generated parameters (DUET, CDC-MMPG).

- :mod:`fedadapt.methods.sessions.duet`, :mod:`fedadapt.methods.sessions.cdc_mmpg`: the
  methods (DUET's hypernetwork; CDC-MMPG's FDA and ADR);
- :mod:`fedadapt.methods.sessions.train`: server training, serving, the clients' side;
- :mod:`fedadapt.methods.sessions.run`: the run (train, serve every session, summarize).
"""

from __future__ import annotations

from fedadapt.methods import Family, register_family
from fedadapt.methods.sessions import cdc_mmpg, duet  # noqa: F401  (register their methods)


def _upload(spec, msg, context):
    from fedadapt.methods.sessions.run import upload

    return upload(spec, msg, context)


def _predict(spec, msg, context):
    from fedadapt.methods.sessions.run import predict

    return predict(spec, msg, context)


class Sessions(Family):
    name = "sessions"
    handlers = {("query", "session-upload"): _upload, ("evaluate", "session-predict"): _predict}

    def prepare(self, cfg, prep, *, backbone, images, original) -> None:
        from fedadapt.methods.server_trained import prepare_fields

        prepare_fields(cfg, prep, backbone=backbone, images=images, original=original)

    def run(self, cfg, run_dir, prep, **kw) -> dict:
        from fedadapt.methods.sessions.run import run_sessions

        return run_sessions(cfg, run_dir, prep, **kw)


register_family(Sessions())
