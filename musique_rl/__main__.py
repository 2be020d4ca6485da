"""``python -m musique_rl [overrides]``: compose the config and hand it to ``run``. Nothing else."""

import hydra
from omegaconf import DictConfig

from musique_rl import schema  # registers the typed schema, the named sweeps and the ${arm:..} resolver

CONF_DIR = str(schema.CONF_DIR)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from musique_rl.job.app import run  # imported late: `--cfg job` and config errors stay fast

    return run(cfg)


if __name__ == "__main__":
    main()
