"""``python -m musique_rl [overrides]``: compose the config and hand it to ``run``. Nothing else."""

import sys

import hydra
from omegaconf import DictConfig

from musique_rl import schema  # registers the typed schema, the named sweeps and the ${arm:..} resolver

CONF_DIR = str(schema.CONF_DIR)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from musique_rl.job.app import run  # imported late: `--cfg job` and config errors stay fast

    return run(cfg)


if __name__ == "__main__":
    # a key the schema lacks fails here, named with the key it is closest to, before Hydra composes
    # (Hydra would say only "Key 'top_nn' not in 'EnvSchema'")
    unknown = schema.unknown_keys(sys.argv[1:])
    if unknown:
        print("config error: unknown key\n  " + "\n  ".join(unknown), file=sys.stderr)
        sys.exit(1)
    main()
