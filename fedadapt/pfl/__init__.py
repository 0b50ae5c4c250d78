"""Personalized federated learning on frozen backbones (``pfl=``) and the client side of the
drift-correcting strategies: :mod:`~fedadapt.pfl.rule` (the extension point),
:mod:`~fedadapt.pfl.kinds` (the registry); FedPer and LG-FedAvg (:mod:`~fedadapt.pfl.fedper`),
FedRep and FedBABU (:mod:`~fedadapt.pfl.fedrep`), Ditto (:mod:`~fedadapt.pfl.ditto`), APFL
(:mod:`~fedadapt.pfl.apfl`); SCAFFOLD's, FedDyn's and MOON's client side
(:mod:`~fedadapt.pfl.drift`). See docs/personalization.md."""
