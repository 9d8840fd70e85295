from dataclasses import dataclass


@dataclass
class AlgoConfig:
    loss: str = "grpo"  # grpo | ppo | decoupled_ppo | aipo | gspo | gspo_token | cispo
    advantage: str = "group_mean"  # group_mean | leave_one_out | reinforce_pp | reinforce_pp_baseline | gae (critic:)
    normalize_std: bool = False  # divide each group's advantages by (std(group) + std_eps)
    std_eps: float = 1e-6
    normalization: str = "auto"  # auto (the loss's paper) | sequences | tokens | sequence_length | constant (Dr. GRPO)
    norm_constant: float = 0.0  # constant: loss = sum / (sequences in step * this); 0 = actor.max_new_tokens
    is_cap: float = 5.0  # grpo: truncated importance weight cap c (inf = untruncated pi/mu, 0 = no weight)
    is_level: str = "token"  # grpo / aipo: the weight of a token is its own pi/mu (token) or its sample's (sequence)
    clip_low: float = 0.2  # ppo / decoupled_ppo epsilon
    clip_high: float = 0.2
    gspo_clip_low: float = 3e-4  # gspo / gspo_token: clip range of the sequence ratio (GSPO paper, sec. 5.1)
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0  # cispo: IS weight clipped to [1 - low, 1 + high]; low >= 1: no lower bound (paper)
    cispo_clip_high: float = 4.0  # the paper tunes it without giving a value: a weight of at most 5, like is_cap
    is_mask: str = "none"  # masked IS: none | sequence (prod of the sample's pi/mu) | geometric (their geo. mean)
    is_mask_low: float = 0.5  # is_mask: a sample whose ratio is below this or above is_mask_high is left out
    is_mask_high: float = 2.0
    behaviour_cap: float = 5.0  # decoupled_ppo: cap of pi_prox / mu
    behaviour_cap_mode: str = "mask"  # mask | clamp
    aipo_rho: float = 4.0
    kl_coef: float = 0.0  # KL to the reference model (the starting weights, frozen; on fsdp2 sharded like the policy)
    kl_clamp: float = 10.0
    kl_reward_coef: float = 0.0  # reinforce_pp*: beta of the per-token KL(mu/ref) in the return (needs the ref model)
    kl_reward_estimator: str = "k1"  # k1: log mu - log ref (REINFORCE++ eq. 9) | k2: (log mu - log ref)^2 / 2
    entropy_coef: float = 0.0
    gamma: float = 1.0  # gae: discount of the token-level rewards (verl's default; the reward sits on the last token)
    lam: float = 1.0  # gae: lambda of GAE (verl's default; OpenRLHF uses 0.95)
    gae_whiten: bool = True  # gae: advantages whitened over the step's trained tokens, (A - mean) / sqrt(var + 1e-8)
    truncated: str = "zero_reward"  # a completion cut off by max_new_tokens: mask | zero_reward | soft_penalty | keep
    overlong_penalty: float = 1.0  # soft_penalty: reward taken off at the length limit (DAPO)
    overlong_buffer: float = 0.2  # soft_penalty: share of max_new_tokens over which the penalty rises to it
