"""``python -m musique_rl [overrides]``: compose the config and hand it to ``run``. Nothing else."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from musique_rl import schema  # noqa: F401  (registers the typed schema and the ${arm:..} resolver)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from musique_rl.app import run  # imported late: `--cfg job` and config errors stay fast

    return run(cfg)


if __name__ == "__main__":
    main()
