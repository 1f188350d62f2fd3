"""``RayStore``: the ranks of a group meet through an actor of the Ray cluster (no file, no
new listener), then run their collectives over gloo directly."""

from __future__ import annotations

import datetime

import pytest

pytestmark = pytest.mark.integration


def test_two_ranks_meet_through_a_rendezvous_actor_and_all_reduce(ray_local):
    import ray

    from services.ray.rendezvous import start_rendezvous

    keeper = start_rendezvous("sluice-test-rendezvous")  # an actor lives while a handle does

    @ray.remote(num_cpus=0, resources={"prefill": 1})
    def rank(r: int) -> list[float]:
        import torch
        import torch.distributed as dist

        from services.ray.rendezvous import RayStore

        store = RayStore(ray.get_actor("sluice-test-rendezvous"), timeout_s=60)
        dist.init_process_group(
            "gloo", store=store, rank=r, world_size=2, timeout=datetime.timedelta(seconds=30)
        )
        try:
            t = torch.tensor([float(r + 1)])
            dist.all_reduce(t)
            return t.tolist()
        finally:
            dist.destroy_process_group()

    assert ray.get([rank.remote(0), rank.remote(1)], timeout=120) == [[3.0], [3.0]]
    ray.kill(keeper)


def test_the_store_answers_like_a_store_and_times_out_clearly(ray_local):
    import ray

    from services.ray.rendezvous import RayStore, start_rendezvous

    store = RayStore(start_rendezvous("sluice-test-kv"), timeout_s=0.5)
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
    assert store.num_keys() == 3 and store.delete_key("c") and store.num_keys() == 2
    with pytest.raises(TimeoutError, match="did not arrive"):
        store.get("never")
    with pytest.raises(TimeoutError, match="did not arrive"):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    ray.kill(ray.get_actor("sluice-test-kv"))
