"""musique_rl's submitit launchers (Hydra finds launcher plugins only under ``hydra_plugins``)."""
