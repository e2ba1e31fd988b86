"""``runtime.on_every_rank`` on a real 2-rank gloo group (two forked processes, a file store)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from memfit.distributed.runtime import DistContext, on_every_rank
from memfit.errors import UserError


def _rank(rank: int, store: str, failing: tuple[int, ...], out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, "gloo")

    def read() -> int:
        if rank in failing:
            raise UserError(f"data.source: bad rows on rank {rank}")
        return 10 + rank

    try:
        got = ("returned", on_every_rank(ctx, read), True)
    except UserError as e:
        got = ("raised", str(e), getattr(e, "echo", True))
    dist.destroy_process_group()
    out.put((rank, got))


@pytest.mark.parametrize(
    "failing, rank0, rank1",
    [
        ((), ("returned", 10, True), ("returned", 11, True)),
        # both found it: rank 0 prints its own, rank 1 exits with it unprinted
        (
            (0, 1),
            ("raised", "data.source: bad rows on rank 0", True),
            ("raised", "data.source: bad rows on rank 0", False),
        ),
        # only rank 1 (another node's files): rank 0 prints it with its rank, and no rank waits for the other
        (
            (1,),
            ("raised", "rank 1: data.source: bad rows on rank 1", True),
            ("raised", "data.source: bad rows on rank 1", False),
        ),
        (
            (0,),
            ("raised", "data.source: bad rows on rank 0", True),
            ("raised", "data.source: bad rows on rank 0", False),
        ),
    ],
)
def test_an_error_any_rank_finds_ends_every_rank_printed_once_by_rank_0(tmp_path, failing, rank0, rank1):
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()
    ranks = [fork.Process(target=_rank, args=(r, str(tmp_path / "store"), failing, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = dict(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == {0: rank0, 1: rank1}
