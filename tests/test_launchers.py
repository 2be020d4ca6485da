"""Launcher configs: the sbatch script a sweep submits, per-cluster settings as config keys (the
command line or a launcher config of the user's own), and the pinned upstream code our launcher
subclass mirrors."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers

ROOT = Path(__file__).resolve().parent.parent


def test_upstream_launch_is_the_version_we_mirror():
    # launchers.py copies hydra-submitit-launcher 1.2.0's launch() up to the submission; a new
    # upstream version must be re-read before this passes again.
    import hydra_plugins.hydra_submitit_launcher as upstream
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    assert upstream.__version__ == "1.2.0"
    src = inspect.getsource(BaseSubmititLauncher.launch)
    assert hashlib.sha256(src.encode()).hexdigest()[:16] == "546875669010f80d"


@pytest.fixture(autouse=True)
def no_cluster_here(monkeypatch):
    """The sbatch script and the executor's parameters are made without a cluster. submitit's
    SlurmExecutor refuses to start where ``srun`` is not on PATH (a bare machine, CI); that check
    guards submission, which these tests never reach (the slow tests submit to a real SLURM)."""
    from submitit.slurm.slurm import SlurmExecutor

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))


def sbatch_script(tmp_path: Path, overrides: list[str], n_jobs: int = 6, launcher: str = "slurm") -> str:
    from hydra_plugins.musique_rl_launchers.launchers import SlurmLauncher

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+sweep=h02", f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}",
                                          *overrides], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params.pop("_target_") == "hydra_plugins.musique_rl_launchers.launchers.SlurmLauncher"
    launcher = SlurmLauncher(**params)
    launcher.config = cfg
    executor, job_params = launcher._executor([[f"seed={i}"] for i in range(n_jobs)], 0)
    assert len(job_params) == n_jobs
    slurm = executor._executor
    slurm.parameters["map_count"] = n_jobs  # what map_array sets for an array of n_jobs
    return slurm._make_submission_file_text("python -u -m submitit.core._submit X", "uid")


def test_sbatch_defaults_leave_cluster_choices_to_the_cluster(tmp_path):
    text = sbatch_script(tmp_path, [])
    for absent in ("--partition", "--account", "--qos", "--gpus-per-node"):
        assert absent not in text
    for line in ("#SBATCH --cpus-per-task=1", "#SBATCH --mem=8GB", "#SBATCH --time=60",
                 "#SBATCH --signal=USR2@120", "#SBATCH --array=0-5%6", "#SBATCH --job-name=musique_rl",
                 "export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1"):
        assert line in text, line
    assert f"#SBATCH --output={tmp_path}/.submitit/%A_%a/%A_%a_0_log.out" in text


def test_a_clusters_own_launcher_config_sets_the_sbatch_flags_and_the_command_line_wins(tmp_path):
    """launchers/cluster.yaml.example, copied into a config dir of the user's (``--config-dir``; here
    hydra.searchpath, its compose-API form), starts from slurm.yaml and sets the cluster's values;
    an override on the command line still beats it."""
    import shutil

    own = tmp_path / "my_conf"
    (own / "hydra" / "launcher").mkdir(parents=True)
    shutil.copy(ROOT / "launchers" / "cluster.yaml.example", own / "hydra" / "launcher" / "mycluster.yaml")
    text = sbatch_script(tmp_path, [f"hydra.searchpath=[file://{own}]", "hydra.launcher.partition=debug",
                                    "+hydra.launcher.additional_parameters.requeue=true"], launcher="mycluster")
    for line in ("#SBATCH --partition=debug", "#SBATCH --account=my_project", "#SBATCH --qos=normal",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32", "#SBATCH --mem=256GB",
                 "#SBATCH --time=720", "#SBATCH --array=0-5%6", "#SBATCH --requeue",
                 "#SBATCH --signal=USR2@120", "export OMP_NUM_THREADS=32 MKL_NUM_THREADS=32"):
        assert line in text, line
    assert "--partition=gpu" not in text


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_launcher_max_num_timeout_reaches_the_executor(tmp_path, launcher):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    if launcher == "local":
        assert params["max_parallel"] == 2 and params["cpus_per_task"] == 1
    else:
        assert params["max_num_timeout"] == 3  # requeues allowed after a timeout/preemption
