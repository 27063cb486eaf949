"""Transports: the local one, gloo, and how "auto" chooses (symmetric memory needs no
environment variable: tpsample never uses NVLink multicast)."""
import torch

from tpsample import transport

from dist_utils import run_world


def test_local_transport_gives_fresh_slots_and_no_fanout():
    t = transport.LocalTransport(torch.device("cpu"))
    mine, full = t.slots(12)
    again, _ = t.slots(12)
    assert full.shape == (1, 12) and full.data_ptr() == mine.data_ptr()
    assert again.data_ptr() != mine.data_ptr() and t.fanout() is None and t.key() == ()
    t.exchange(mine, full)


def _gloo(rank, world):
    import torch.distributed as dist
    t = transport.make_transport("auto", dist.group.WORLD, torch.device("cpu"), 30.0)
    mine, full = t.slots(5)
    mine.fill_(rank + 1)
    t.exchange(mine, full)
    usable, why = transport.symm_mem_usable(dist.group.WORLD, torch.device("cpu"))
    return dict(name=t.name, full=full.clone(), usable=usable, why=why)


def test_auto_picks_gloo_on_cpu_and_every_slot_arrives():
    res = run_world(2, _gloo)
    for r in res:
        assert r["name"] == "gloo" and torch.equal(r["full"], torch.tensor([[1.0] * 5, [2.0] * 5]))
        assert not r["usable"] and "CPU" in r["why"]


def _fake_group(monkeypatch, where):
    """symm_mem_usable's view of a group whose ranks sit at `where` [(host, GPU index)]."""
    def gather(out, obj, group=None):
        out[:] = where
    monkeypatch.setattr(transport.dist, "get_world_size", lambda group: len(where))
    monkeypatch.setattr(transport.dist, "all_gather_object", gather)


def test_symm_mem_is_usable_wherever_p2p_works_without_the_multicast_variable(monkeypatch):
    """Two GPUs of one host that reach each other over P2P: symmetric memory, whether or
    not TORCH_SYMM_MEM_DISABLE_MULTICAST is set (tpsample never uses multicast); a pair
    without P2P: not usable, and the reason names the GPUs; ranks on two hosts or sharing a
    GPU (torch's rendezvous refuses overlapping devices): not usable."""
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    _fake_group(monkeypatch, [("h", 0), ("h", 1)])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert usable, why
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "GPU 0 cannot reach GPU 1" in why
    _fake_group(monkeypatch, [("h", 0), ("h", 0)])
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "share a GPU" in why
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    _fake_group(monkeypatch, [("h", 0), ("g", 1)])
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "several hosts" in why
