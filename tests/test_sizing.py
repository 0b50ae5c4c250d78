"""Workers and clients per worker (fedadapt.federation.sizing): what auto picks on the CPU,
explicit values, clamping with a note, and bad values named."""

import os

import pytest

from fedadapt.config import ConfigError, FederationConfig
from fedadapt.federation.sizing import CPU_IMAGES_PER_STEP, size_simulation


def fed(**kw) -> FederationConfig:
    return FederationConfig(**kw)


def test_auto_on_the_cpu_one_worker_per_two_cores_and_a_bounded_group():
    s = size_simulation(fed(), "cpu", sampled=100, batch_size=10)
    assert s.workers == max(1, (os.cpu_count() or 1) // 2)
    per_worker = -(-100 // s.workers)
    assert s.group_size == min(per_worker, CPU_IMAGES_PER_STEP // 10)
    assert s.num_gpus == 0.0 and s.num_cpus >= 1


def test_a_model_that_trains_whole_trains_its_clients_one_after_another_on_the_cpu():
    s = size_simulation(fed(), "cpu", sampled=10, batch_size=32, trains_whole=True)
    assert s.group_size == 1 and "trains whole" in s.note
    forced = size_simulation(fed(clients_per_worker="3"), "cpu", sampled=10, batch_size=32,
                             trains_whole=True)
    assert forced.group_size == 3  # an explicit K is kept


def test_explicit_values_and_a_k_above_the_clients_per_worker_is_clamped_with_a_note():
    s = size_simulation(fed(workers="2", clients_per_worker="50"), "cpu", sampled=10,
                        batch_size=10)
    assert s.workers == 2 and s.group_size == 5
    assert "more than the 5 clients a worker gets per round" in s.note


@pytest.mark.parametrize("key,value", [("workers", "0"), ("clients_per_worker", "zero"),
                                       ("clients_per_worker", "-2")])
def test_bad_counts_are_named(key, value):
    with pytest.raises(ConfigError, match=f"federation.{key}"):
        size_simulation(fed(**{key: value}), "cpu", sampled=10, batch_size=10)
