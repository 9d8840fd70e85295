"""FSDP2 training backend: `torch.distributed.fsdp.fully_shard` across processes (one per device, or several CPU
processes with gloo). Same interface as SingleDeviceTrainer.

Launch one process per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (torchrun, or
torch.multiprocessing), or initialise the default process group yourself before `init()`.

Collective calls (every rank must make them, in the same order): init, forward_logprobs, backward,
optimizer_step, named_weights (iterate it to the end on every rank; rank 0 broadcasts the tensors, the others
discard them), save, train_state, load_train_state. Each rank packs its own samples; StepAccumulator keeps the
number of forward/backward passes equal across ranks. Losses normalise by counts of the whole step over all
ranks, so gradients are SUMMED across ranks (divide factor 1), which makes the step identical to one process doing
all the micro-batches.

gloo has no PREMUL_SUM / AVG reduce-scatter: with divide factor 1 we force plain SUM collectives, which gloo runs.

Two process groups over the same ranks: the default one (NCCL on CUDA, gloo on CPU) carries FSDP's collectives on
device tensors; `cpu_group`, always gloo, carries the small collectives on CPU tensors (the step's samples, the stop
flag, micro-batch counts, barriers). NCCL has no CPU tensors, so these must never use the default group; the CPU
runs (tests) use the very same layout, so the group choice is exercised without a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, ValueType, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from inflight.transport.layout import tied_aliases
from inflight.config.trainer import TrainerConfig
from inflight.trainer.kernels.fused import fuse_modules
from inflight.trainer.lora import check_adapter_fits, is_lora, read_adapter, save_adapter
from inflight.trainer.optim import build_optimizer
from inflight.trainer.single import SingleDeviceTrainer, attn_implementation, for_training, freeze, load_model

# Ranks > 0 wait in their first collective while rank 0 waits for the servers (pipeline.startup_timeout_s: up to
# 13 min for four vLLM servers) and forms the weight group (up to 10 min): a dead rank stops the run through the
# launcher, this only bounds a hung one.
TIMEOUT = timedelta(minutes=30)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Transformer blocks to shard one by one: the classes HF names in `_no_split_modules` (e.g. LlamaDecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:  # unknown architecture: the repeated layers of the first ModuleList
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = list(lists[0]) if lists else []
    return blocks


class FSDP2Trainer(SingleDeviceTrainer):
    """TrainEngine over all ranks of the default process group: SingleDeviceTrainer's steps on a model sharded with
    fully_shard (forward, backward, clipping and named_weights work on the sharded tensors; every call is
    collective). Attributes: model, tokenizer, version, rank, world_size."""

    train_state_from_rank0 = True  # load_train_state uses rank 0's optimizer state only (restore_trainer maps it)

    def __init__(self, model_path: str, cfg: TrainerConfig, frozen: bool = False):
        super().__init__(model_path, cfg, frozen)
        self.device = torch.device("cpu")  # set per rank in init()
        self.rank, self.world_size = 0, 1
        self.cpu_group: dist.ProcessGroup | None = None  # gloo over all ranks, for CPU tensors (init)
        self.skeleton: PreTrainedModel | None = None  # rank 0: what save() writes the HF folder with (init)

    def init(self) -> None:
        if self.cfg.threads > 0:
            torch.set_num_threads(self.cfg.threads)
        cuda = self.cfg.device.startswith("cuda")
        if cuda:  # the device first: NCCL binds each rank's communicator to the current device
            local = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
            self.device = torch.device("cuda", int(local) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT,
                                    device_id=self.device if cuda else None)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # collective: every rank, same order
        if self.world_size == 1 and not self.cfg.fsdp_shard_one_rank:
            self._init_plain()
            return
        # Only rank 0 reads the checkpoint (full float32 on the host, once per machine instead of once per rank);
        # every rank builds the model on the meta device, shards it, allocates its shard on the device, and gets
        # the values from rank 0: parameters and persistent buffers by set_model_state_dict(broadcast_from_rank0),
        # non-persistent buffers (rotary inv_freq) by a broadcast each.
        source = self._source_model("cpu") if self.rank == 0 else None
        model = self._meta_model()
        if self.frozen:  # before sharding: FSDP2 makes its sharded parameters with the same requires_grad
            freeze(model)
        mp = MixedPrecisionPolicy()  # fully_shard's default: no casts
        if self.cfg.precision == "bf16-mixed":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh: DeviceMesh | None = init_device_mesh("cuda", (self.world_size,)) if cuda else None
        for block in _blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum: losses already normalise by the whole step
                m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
        model.to_empty(device=self.device)
        self._values_from_rank0(model, source)
        del source
        self.model = model
        self._finish_init()

    def _finish_init(self) -> None:
        """The skeleton save() writes with, the tokenizer and the optimizer; a frozen reference needs none of them
        (and is put in eval mode)."""
        assert self.model is not None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.frozen:
            freeze(self.model)
            return
        if self.rank == 0 and self.cfg.lora is None:
            self.skeleton = self._skeleton()
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), self.cfg)

    def _skeleton(self) -> PreTrainedModel:
        """The model_path architecture on the meta device with the folder's config and generation config, read once
        here: save() writes checkpoints with its save_pretrained (HF's layout: tied aliases dropped, shards, the
        config as loaded), never reading model_path again (a resumed run's model_path is a checkpoint that pruning
        deletes)."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=torch.float32)
        if os.path.isfile(os.path.join(self.model_path, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(self.model_path)
        return model

    def _init_plain(self) -> None:
        """One rank: nothing to shard. The plain module, as the single-device trainer holds it (float32 weights and
        gradients, bf16-mixed by autocast), without FSDP's per-block copies and hooks; every collective method keeps
        working on it."""
        self.model = self._source_model(self.device)
        if self.device.type == "cpu":
            fuse_modules(self.model)  # as SingleDeviceTrainer.init
        self._finish_init()

    def _source_model(self, device: torch.device | str) -> PreTrainedModel:
        """The model read from model_path (rank 0's source of the values; the plain module at one rank)."""
        return load_model(self.model_path, self.cfg, device)

    def _meta_model(self) -> PreTrainedModel:
        """The architecture of model_path with no storage (tied weights tied, as from_pretrained ties them)."""
        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation=attn_implementation(self.cfg))
        return for_training(model, self.cfg, self.model_path, self.device, self.world_size)

    def _values_from_rank0(self, model: torch.nn.Module, source: torch.nn.Module | None) -> None:
        """Collective: rank 0's loaded weights into every rank's shards, its buffers into every rank's buffers."""
        full = source.state_dict() if source is not None else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        theirs = dict(source.named_buffers()) if source is not None else {}
        group = None if self.device.type == "cuda" else self.cpu_group  # device tensors: NCCL on CUDA
        with torch.no_grad():
            for name, buf in model.named_buffers():  # the same order on every rank
                if source is not None:
                    buf.copy_(theirs[name])
                dist.broadcast(buf, 0, group=group)

    def save(self, out_dir: str) -> None:
        """Collective; rank 0 writes the HF folder (weights gathered one tensor at a time); with trainer.lora the
        adapter in PEFT's format instead."""
        model = self._require_init()
        state = {}
        for name, tensor in self.named_weights():
            if self.rank == 0:
                state[name] = tensor.cpu()
        if self.rank == 0 and is_lora(model):
            save_adapter(model, out_dir, state)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out_dir)
        elif self.rank == 0:
            skeleton = self.skeleton
            assert skeleton is not None  # rank 0 of a full fine-tuning run builds it in init()
            state.update(_persistent_buffers(model))
            expected = set(skeleton.state_dict()) - set(tied_aliases(skeleton))  # named_weights omits them
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            if missing or unexpected:
                raise RuntimeError(f"save: weights do not fit the model (missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]})")
            skeleton.save_pretrained(out_dir, state_dict=state)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out_dir)
        dist.barrier(group=self.cpu_group)

    def load_adapter(self, path: str) -> None:
        """Collective: every rank reads the checkpoint's adapter (as each reads its train state) and keeps its
        shard of it."""
        model = self._require_init()
        adapter = read_adapter(path)
        check_adapter_fits(model, adapter, path)  # the same answer on every rank: none waits alone
        state: dict[str, ValueType] = dict(adapter)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    # ---- checkpoints: the sharded optimizer state, gathered into one full (unsharded) state dict --------------
    def train_state(self) -> dict:
        """Collective. The optimizer state unsharded and keyed by parameter name (what a single process would hold;
        it loads on any number of ranks), the scheduler state and the version. Rank 0 gets the tensors (on CPU),
        the other ranks an empty optimizer dict: only rank 0 writes."""
        model = self._require_init()
        osd = get_optimizer_state_dict(model, self.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"optimizer": osd, "scheduler": self.scheduler.state_dict(), "version": self.version,
                "backend": "fsdp2"}

    def load_train_state(self, state: dict) -> None:
        """Collective; every rank passes the state read from the checkpoint, and only rank 0's optimizer state is
        read: it goes to the other ranks tensor by tensor and each keeps its shard (one full copy on the host, not
        one per rank: restore_trainer maps the file, so the other ranks never read those tensors)."""
        model = self._require_init()
        if state.get("backend") != "fsdp2":
            raise ValueError("this checkpoint's optimizer state was written by another trainer backend "
                             f"({state.get('backend', 'single')!r}); resume it with that backend")
        set_optimizer_state_dict(model, self.optimizer, state["optimizer"] if self.rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that belong in a state dict (not rotary inv_freq and the like), on the host; FSDP2 leaves buffers
    whole on every rank."""
    return {f"{prefix}{'.' if prefix else ''}{name}": buf.detach().cpu()
            for prefix, mod in model.named_modules() for name, buf in mod.named_buffers(recurse=False)
            if name not in mod._non_persistent_buffers_set}
