"""Typed configuration: dataclasses per role, loaded from YAML with dotted command-line overrides (OmegaConf).

    cfg = load_config(RunConfig, "configs/cpu-demo.yaml", ["trainer.lr=1e-4", "actor.max_lag=2"])

Unknown keys and wrong types fail with one message that names the key (and the closest valid key).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from inflight.config.actor import ActorConfig
from inflight.config.algo import AlgoConfig
from inflight.config.critic import CriticConfig
from inflight.config.engine import ServerConfig
from inflight.config.pipeline import PipelineConfig
from inflight.config.tasks import TaskConfig
from inflight.config.trainer import TrainerConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, with a message meant for the user."""


@dataclass
class ModelConfig:
    path: str = "runs/models/tiny"  # any folder AutoModelForCausalLM.from_pretrained loads
    size: str = "tiny"  # for `make-model` when path does not exist: tiny | small


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # the value model of algo.advantage=gae
    actor: ActorConfig = field(default_factory=ActorConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


def _valid_keys(schema: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            keys.extend(_valid_keys(type(sub), key + "."))
    return keys


def _explain(exc: Exception, schema: type) -> ConfigError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError  # lazy: start-up cost

    key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)):
        close = difflib.get_close_matches(key, _valid_keys(schema), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return ConfigError(f"unknown config key '{key}'{hint}")
    if isinstance(exc, ValidationError):
        msg = str(exc).splitlines()[0]
        return ConfigError(f"bad value for config key '{key}': {msg}")
    return ConfigError(str(exc))


def load_config(schema: type[T], yaml_path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Schema defaults <- YAML file <- `key.sub=value` overrides; returns a plain dataclass instance."""
    from omegaconf import OmegaConf  # lazy: start-up cost (~0.2 s) for users of the dataclasses alone
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError  # lazy: as above

    try:
        cfg = OmegaConf.structured(schema)
        if yaml_path is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(yaml_path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"override '{bad[0]}' is not of the form key.sub=value")
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except ConfigError:
        raise
    except (ConfigAttributeError, ConfigKeyError, ValidationError) as exc:
        raise _explain(exc, schema) from None


def to_yaml(cfg: object) -> str:
    """Any config dataclass instance (a RunConfig, one role's config) as YAML."""
    from omegaconf import OmegaConf  # lazy: start-up cost (~0.2 s) for users of the dataclasses alone

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: object, run_dir: str | Path) -> Path:
    """Every run writes its resolved config next to its outputs."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path
