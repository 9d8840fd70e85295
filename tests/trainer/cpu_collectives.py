"""Make the default process group refuse CPU tensors from inflight's code, as NCCL (the default group on CUDA)
does, so the CPU FSDP2 tests fail wherever inflight sends a host tensor to the default group instead of the
trainer's gloo cpu_group. torch's own calls (FSDP, set_model_state_dict) pass: on CPU their device tensors are CPU
tensors, on CUDA they are CUDA tensors. Call in a rank process before the trainer starts."""

import sys

import torch
import torch.distributed as dist

REFUSED: list[str] = []


def default_group_refuses_cpu_tensors() -> None:
    def guard(name, real):
        def call(tensor, *args, group=None, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if (tensor.device.type == "cpu" and (group is None or group is dist.group.WORLD)
                    and caller.startswith("inflight")):
                REFUSED.append(name)
                raise RuntimeError(f"{name} of a CPU tensor on the default group (NCCL on CUDA has no CPU tensors)")
            return real(tensor, *args, group=group, **kwargs)
        return call

    for name in ("broadcast", "all_reduce"):
        setattr(dist, name, guard(name, getattr(dist, name)))
    real_barrier = dist.barrier

    def barrier(group=None, **kwargs):  # on NCCL it needs the device set; ours go to the gloo group
        if (group is None or group is dist.group.WORLD) and sys._getframe(1).f_globals.get(
                "__name__", "").startswith("inflight"):
            REFUSED.append("barrier")
            raise RuntimeError("barrier on the default group; the trainer's barriers use cpu_group")
        return real_barrier(group=group, **kwargs)

    dist.barrier = barrier
    torch.distributed.barrier = barrier
