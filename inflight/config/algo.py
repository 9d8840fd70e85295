from dataclasses import dataclass


@dataclass
class AlgoConfig:
    loss: str = "grpo"  # grpo | ppo | decoupled_ppo | aipo
    advantage: str = "group_mean"  # group_mean | leave_one_out
    normalize_std: bool = False  # divide each group's advantages by (std(group) + std_eps)
    std_eps: float = 1e-6
    normalization: str = "sequences"  # sequences | tokens | sequence_length
    is_cap: float = 5.0  # grpo: truncated importance weight cap c (inf = untruncated pi/mu, 0 = no weight)
    is_level: str = "token"  # grpo / aipo: the weight of a token is its own pi/mu (token) or its sample's (sequence)
    clip_low: float = 0.2  # ppo / decoupled_ppo epsilon
    clip_high: float = 0.2
    behaviour_cap: float = 5.0  # decoupled_ppo: cap of pi_prox / mu
    behaviour_cap_mode: str = "mask"  # mask | clamp
    aipo_rho: float = 4.0
    kl_coef: float = 0.0  # reference-model KL
    kl_clamp: float = 10.0
    entropy_coef: float = 0.0
    truncated: str = "zero_reward"  # a completion cut off by max_new_tokens: mask | zero_reward | soft_penalty | keep
    overlong_penalty: float = 1.0  # soft_penalty: reward taken off at the length limit (DAPO)
    overlong_buffer: float = 0.2  # soft_penalty: share of max_new_tokens over which the penalty rises to it
