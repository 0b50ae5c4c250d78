"""Clients side by side, below the federation: what a module computes for many clients at once.

* :mod:`fedadapt.grouping.forms`: the grouped forms of the modules clients train (a batch of K
  clients' rows, each client's tensors applied to its own rows by batched products);
* :mod:`fedadapt.grouping.dropout`: dropout whose masks are each client's own, alone or in any
  group.

Methods (:mod:`fedadapt.adapters`) register the forms of their own modules here; the training
loop (:mod:`fedadapt.federation.client.grouped`) uses them. This package imports only torch and
numpy.
"""
