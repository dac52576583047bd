"""The CPU KV pool: zero without being written up front, made resident in the background."""
import torch

from pagedserve.runner.cpu_memory import HUGE_PAGE, Populator, zeroed_cpu_tensor


def _resident_bytes(addr: int, nbytes: int) -> int | None:
    """Bytes of [addr, addr+nbytes) present in RAM, from /proc/self/pagemap (None where unreadable)."""
    import struct

    page = 4096
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // page * 8)
            entries = f.read(nbytes // page * 8)
    except OSError:
        return None
    return sum(page for (e,) in struct.iter_unpack("<Q", entries) if e >> 63)


def test_pool_is_zero_aligned_and_populated_in_the_background():
    t, (addr, nbytes) = zeroed_cpu_tensor((64, 16, 4, 64), torch.float32)  # 1 MiB, and one of 64 MiB
    big, region = zeroed_cpu_tensor((4096, 16, 4, 64), torch.float32)
    assert t.data_ptr() == addr and addr % HUGE_PAGE == 0 and nbytes == t.numel() * 4
    assert big.data_ptr() % HUGE_PAGE == 0 and not t.any()
    big[3, 2] = 1.5  # the engine may write K/V while the pages are faulted in: nothing is overwritten
    p = Populator([region, (addr, nbytes)])
    p.start()
    assert p.wait(60)
    after = _resident_bytes(*region)
    if after:  # pagemap readable here (whether the pages were fresh before depends on the allocator's history)
        assert after == region[1]
    assert float(big[3, 2, 0, 0]) == 1.5 and float(big.sum()) == 1.5 * 4 * 64 and not t.any()


def test_engine_pool_reports_resident(llama_dir, monkeypatch):
    from pagedserve import LLM

    monkeypatch.setenv("PAGEDSERVE_POPULATE_KV", "1")
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64)
    assert llm.llm_engine.kv_cache.wait_resident(60)


def test_pool_is_private_memory():
    """Private anonymous memory: huge pages apply, and a forked child never writes into our pool
    (an anonymous MAP_SHARED mapping would be shmem, shared across fork)."""
    t, (addr, nbytes) = zeroed_cpu_tensor((256, 16, 4, 64), torch.float32)  # 4 MiB
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            assert line.split()[1][3] == "p", line
            break
    else:
        raise AssertionError("pool address not in /proc/self/maps")
