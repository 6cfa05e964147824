"""Fault tolerance on the real runtime: membership epochs agreed on torch elastic's rendezvous
(`ft.rendezvous`), deadlines and rejoin from a live peer (`ElasticComm`), the supervising local
launcher, and fault injection (docs/fault_tolerance.md)."""

from frugaltrain.ft.comm import ElasticComm
from frugaltrain.ft.inject import Fault, Injector, parse

__all__ = ["ElasticComm", "Fault", "Injector", "parse"]
