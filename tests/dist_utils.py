"""Run a function on `world` local gloo ranks (torch.multiprocessing) and collect results."""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if os.environ.get("TRITON_INTERPRET") == "1":  # (ranks import this module, not conftest)
    import interpreter_speedups
    interpreter_speedups.install()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, backend, fn, args, hard_exit=False):
    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1")):  # never NVLink multicast
            os.environ[var] = val
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kw)
    try:
        result = fn(rank, world, *args)
    except Exception as e:  # reported to the parent, which asserts on it
        result = {"error": type(e).__name__, "message": str(e)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if hard_exit:  # a process whose communicator was aborted: end it as a service restarts it
        os._exit(0)
    dist.destroy_process_group()


def run_world(world: int, fn, *args, backend: str = "gloo", hard_exit: bool = False):
    """fn(rank, world, *args) on every rank → list of per-rank results (or error dicts).
    Results are moved to the CPU by torch.save/load (map_location). hard_exit: each rank
    ends with os._exit after saving its result (no process-group teardown)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, free_port(), d, backend, fn, args, hard_exit),
                 nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False, map_location="cpu")
                for r in range(world)]
