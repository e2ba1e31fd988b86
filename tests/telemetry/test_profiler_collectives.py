"""The profiler sees every release of a collective's tensors once they are made on the caller's thread."""

import torch
import torch.distributed as dist

from memfit.telemetry.profiler import allocation_events, collectives_release_on_caller, live_blocks


def _profiled(fn, skip_inside=()):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocation_events(prof, "cpu", skip_inside)


def test_collective_tensors_are_released_where_the_profiler_sees_it(tmp_path):
    """FSDP2's collectives (all-gather into a tensor, reduce-scatter, async and waited) on gloo: with the
    context, every block the program allocated ends in a release the profiler saw (none left live, none ended
    only by the reuse of its address), and gloo's private copies made inside its ops are left out."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:

        def step():
            for _ in range(8):
                out = torch.empty(1 << 20)
                dist.all_gather_into_tensor(out, torch.ones(1 << 20))
                grads = torch.ones(1 << 20)
                shard = torch.empty(1 << 20)
                dist.reduce_scatter_tensor(shard, grads, async_op=True).wait()
                del out, grads, shard

        with collectives_release_on_caller():
            events = _profiled(step, ("c10d::",))
        blocks = [b for b in live_blocks(events)[0] if b.nbytes >= 4 << 20]
        assert len(blocks) >= 32
        assert all(b.end is not None and events[b.end][2] < 0 for b in blocks)
        assert dist.all_gather_into_tensor.__name__ == "all_gather_into_tensor"  # the collectives are put back
    finally:
        dist.destroy_process_group()
