from dataclasses import dataclass


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (`algo.advantage: gae`): a copy of the policy's body with a scalar head,
    trained by the trainer alongside the policy with its own optimizer. Its other settings (precision, device,
    micro-batch budget, betas, schedule, grad clipping, trainer.lora) are the trainer's; with trainer.backend=fsdp2
    it is sharded like the policy (with trainer.lora too: its own adapter on the frozen base, and the head)."""

    model_path: str = ""  # the body's weights: a causal-LM folder ("": the policy's model.path); the head starts at 0
    lr: float = 0.0  # its own AdamW's learning rate (0: trainer.lr), on the trainer's schedule
    weight_decay: float = 0.0  # its AdamW's weight decay
    value_clip: float = 0.5  # PPO's clipped value loss: V within old V ± this (verl's cliprange_value); 0: no clip
    mini_batches: int = 1  # critic optimizer steps per trainer step, one per slice of its samples (clip: from the 2nd)
    warmup_steps: int = 0  # first trainer steps that train the critic alone (policy weights kept; verl's critic_warmup)
