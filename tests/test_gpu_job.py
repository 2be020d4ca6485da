"""GPU job topology: the exact commands a vLLM-backed job starts (checked as strings: no GPU here),
and the start / health-check / stop machinery run on loopback with stand-in processes."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from musique_rl import gpu_job
from musique_rl.schema import CONF_DIR, job_config  # importing it registers the schema and resolvers
from tests.conftest import with_keys

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cfg7b():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return job_config(compose("train", overrides=["model=qwen2.5-7b-instruct", "lora=r16", "train.backend=vllm",
                                                      "+hypothesis=h02", "hypothesis.arm=control", "seed=2"]))


def test_plan_puts_vllm_on_the_first_gpus_and_trains_on_the_rest(cfg7b, tmp_path):
    """4 GPUs, 8 prompts: 3 trainer processes cannot hold whole groups, so 2 train and vLLM serves
    from the other 2 as two data-parallel replicas."""
    overrides = ["model=qwen2.5-7b-instruct", "lora=r16", "train.backend=vllm", "+hypothesis=h02",
                 "hypothesis.arm=control", "seed=2", "train.vllm_server_port=8000", "train.vllm_group_port=51216"]
    cfg = with_keys(cfg7b, {"train.vllm_server_port": 8000, "train.vllm_group_port": 51216,  # explicit ports are kept
                            "gpu.accelerate_config": str(tmp_path / "zero3.yaml"), "gpu.vllm_max_model_len": 16384})
    topo = gpu_job.plan(cfg, gpus=["4", "5", "6", "7"], job_dir=tmp_path / "job", overrides=overrides, env={})
    server = " ".join(topo.server_cmd)
    assert server.startswith("python -m vllm.entrypoints.cli.main serve Qwen/Qwen2.5-7B-Instruct --host 127.0.0.1 --port 8000")
    for part in ("--tensor-parallel-size 1", "--data-parallel-size 2", "--dtype bfloat16", "--max-model-len 16384",
                 "--gpu-memory-utilization 0.9", "--logprobs-mode processed_logprobs"):
        assert part in server
    assert topo.server_env == {"CUDA_VISIBLE_DEVICES": "4,5", "VLLM_SERVER_DEV_MODE": "1"}
    assert topo.health_url == "http://127.0.0.1:8000/health"
    cmd = topo.trainer_cmd
    main_port = cmd[cmd.index("--main_process_port") + 1]
    assert cmd == ["accelerate", "launch", "--config_file", str(tmp_path / "zero3.yaml"), "--num_processes", "2",
                   "--main_process_port", main_port, "-m", "musique_rl", *overrides[:6],
                   "train.vllm_mode=server", "train.vllm_server_port=8000", "train.vllm_group_port=51216",
                   f"hydra.run.dir={tmp_path / 'job'}"]
    assert int(main_port) not in (8000, 51216)
    assert topo.trainer_env == {"CUDA_VISIBLE_DEVICES": "6,7", "MUSIQUE_RL_GPU_ROLE": "trainer"}
    assert topo.notes == [f"gpu.accelerate_config={tmp_path / 'zero3.yaml'}: no such file"]
    shell = topo.shell()
    assert "CUDA_VISIBLE_DEVICES=6,7 MUSIQUE_RL_GPU_ROLE=trainer accelerate launch" in shell
    assert "until curl -sf http://127.0.0.1:8000/health" in shell
    assert "# note: 3 trainer processes cannot split train.prompts_per_step=8" in shell


def _ports(topo: gpu_job.Topology) -> tuple[int, int, int]:
    cmd = topo.trainer_cmd
    value = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in cmd if o.startswith("train.vllm_")}
    server = int(topo.server_cmd[topo.server_cmd.index("--port") + 1])
    assert int(value["train.vllm_server_port"]) == server  # the trainer talks to the server it started
    return server, int(value["train.vllm_group_port"]), int(cmd[cmd.index("--main_process_port") + 1])


def test_ports_are_chosen_free_at_start_so_two_jobs_share_a_node(cfg7b, tmp_path):
    """No port in the config: every port is one nobody listens on when the job starts. A second job
    on the node, started while the first one's server and trainer hold their ports, gets others."""
    first = _ports(gpu_job.plan(cfg7b, gpus=["0", "1"], job_dir=tmp_path / "a", overrides=[], env={}))
    assert len(set(first)) == 3
    held = []
    try:
        for port in first:  # the first job's processes bind what it chose
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        second = _ports(gpu_job.plan(cfg7b, gpus=["2", "3"], job_dir=tmp_path / "b", overrides=[], env={}))
    finally:
        for s in held:
            s.close()
    assert len(set(second)) == 3 and not set(first) & set(second)


def test_a_port_given_on_the_command_line_is_replaced_by_the_chosen_one_once(cfg7b, tmp_path):
    cfg = with_keys(cfg7b, {"train.vllm_server_port": 8123})
    topo = gpu_job.plan(cfg, gpus=["0", "1"], job_dir=tmp_path, overrides=["train.vllm_server_port=8123", "seed=2"], env={})
    assert [o for o in topo.trainer_cmd if o.startswith("train.vllm_server_port")] == ["train.vllm_server_port=8123"]
    assert "seed=2" in topo.trainer_cmd and "--port" in topo.server_cmd


def test_one_gpu_is_refused_in_server_mode_with_the_fix_named(cfg7b, tmp_path):
    with pytest.raises(gpu_job.TopologyError, match="at least 2 GPUs.*sees 1.*vllm_mode=colocate"):
        gpu_job.plan(cfg7b, gpus=["0"], job_dir=tmp_path, overrides=[], env={}, mode="server")


def test_auto_mode_colocates_on_one_gpu_and_serves_on_several(cfg7b, monkeypatch):
    cfg = cfg7b
    assert cfg.train.vllm_mode == "auto"
    assert gpu_job.resolve_vllm_mode(cfg.train, env={"CUDA_VISIBLE_DEVICES": "0"}) == "colocate"
    assert gpu_job.resolve_vllm_mode(cfg.train, env={"CUDA_VISIBLE_DEVICES": "0,1"}) == "server"
    # inside `accelerate launch` of several processes: one engine per process, never a nested topology
    assert gpu_job.resolve_vllm_mode(cfg.train, env={"CUDA_VISIBLE_DEVICES": "0,1", "WORLD_SIZE": "2"}) == "colocate"
    cfg = with_keys(cfg7b, {"train.vllm_mode": "colocate"})
    assert gpu_job.resolve_vllm_mode(cfg.train, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == "colocate"
    monkeypatch.delenv(gpu_job.ROLE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not gpu_job.wants_topology(cfg7b)  # one GPU, auto: this process trains with vLLM colocated
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_job.wants_topology(cfg7b)
    with pytest.raises(ValueError, match="(?s)nope.*auto, colocate, server.*train.vllm_mode"):
        with_keys(cfg7b, {"train.vllm_mode": "nope"})  # the typed schema refuses it, naming the key


def test_only_the_outer_vllm_training_job_starts_a_topology(cfg7b, monkeypatch):
    monkeypatch.delenv(gpu_job.ROLE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert gpu_job.wants_topology(cfg7b)
    monkeypatch.setenv(gpu_job.ROLE_ENV, "trainer")  # the accelerate-launched processes train
    assert not gpu_job.wants_topology(cfg7b)


def test_visible_gpus_follow_the_allocation():
    assert gpu_job.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]


def test_dry_run_cli_prints_the_commands(capsys):
    assert gpu_job.main(["--gpus", "2", "--job-dir", "/tmp/j", "model=qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "serve Qwen/Qwen3-8B" in out and "--num_processes 1" in out and "CUDA_VISIBLE_DEVICES=1 " in out


# ---------------------------------------------------------------- the machinery, on loopback
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_topology(tmp_path: Path, trainer_code: str, server_code: str | None = None) -> gpu_job.Topology:
    """A stand-in server answering /health on loopback (http.server over a dir holding `health`)."""
    port = free_port()
    www = tmp_path / "www"
    www.mkdir()
    (www / "health").write_text("ok")
    server = server_code and [sys.executable, "-c", server_code] or [
        sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(www)]
    return gpu_job.Topology(
        server_cmd=server, server_env={"CUDA_VISIBLE_DEVICES": "0"},
        trainer_cmd=[sys.executable, "-c", trainer_code], trainer_env={"CUDA_VISIBLE_DEVICES": "1,2", "MUSIQUE_RL_GPU_ROLE": "trainer"},
        health_url=f"http://127.0.0.1:{port}/health", job_dir=tmp_path / "job")


def test_execute_waits_for_health_runs_the_trainer_and_stops_the_server(tmp_path):
    marker = tmp_path / "trained"
    code = (f"import os, urllib.request; urllib.request.urlopen({'{url}'!r}.format(url=os.environ['H'])); "
            f"open({str(marker)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'] + ' ' + os.environ['MUSIQUE_RL_GPU_ROLE'])")
    topo = fake_topology(tmp_path, code)
    topo.trainer_env["H"] = topo.health_url
    pids_before = set(os.listdir("/proc"))
    assert gpu_job.execute(topo, health_timeout_s=30, poll_s=0.2) == 0
    assert marker.read_text() == "1,2 trainer"  # it ran after the server answered, on the other GPUs
    assert not gpu_job._healthy(topo.health_url)  # the server is gone
    assert (topo.job_dir / "vllm_server.log").exists()
    assert not any(p.isdigit() and p not in pids_before and "http.server" in _cmdline(p) for p in os.listdir("/proc"))


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def test_server_that_dies_fails_the_job_with_its_log(tmp_path):
    topo = fake_topology(tmp_path, "print('never')", server_code="import sys; print('CUDA error: no device'); sys.exit(3)")
    with pytest.raises(gpu_job.TopologyError, match="exited with code 3(.|\n)*CUDA error: no device"):
        gpu_job.execute(topo, health_timeout_s=30, poll_s=0.2)


def test_failing_trainer_returns_its_code_and_still_stops_the_server(tmp_path):
    topo = fake_topology(tmp_path, "import sys; sys.exit(7)")
    assert gpu_job.execute(topo, health_timeout_s=30, poll_s=0.2) == 7
    assert not gpu_job._healthy(topo.health_url)


# ---------------------------------------------------------------- layouts for 1, 2, 4 and 8 GPUs
H100 = gpu_job.H100_GIB
SEEDS = ["model=qwen2.5-7b-instruct", "lora=r16", "env=musique", "env.data=unused", "train.backend=vllm"]


def _cfg(*extra: str):
    from tests.conftest import job_cfg

    return job_cfg([*SEEDS, *extra])


def _layout(cfg, gpus: int, mode: str, card=H100):
    return gpu_job.layout(cfg, gpus, mode, card_gib=card, accelerate_config=gpu_job.DEFAULT_ACCELERATE_CONFIG)


# GPUs, mode -> (trainer processes, vLLM GPUs, episodes per process, micro-batches) at the defaults
# (8 prompts x 8 generations, micro-batch 4 from the 7B config)
EXPECTED = {
    (1, "colocate"): (1, 0, 64, 16),
    (2, "colocate"): (2, 0, 32, 8),
    (4, "colocate"): (4, 0, 16, 4),
    (8, "colocate"): (8, 0, 8, 2),
    (2, "server"): (1, 1, 64, 16),
    (4, "server"): (2, 2, 32, 8),  # 3 trainers cannot hold whole groups of 8 prompts
    (8, "server"): (4, 4, 16, 4),  # nor can 7
}


@pytest.mark.parametrize("gpus,mode", sorted(EXPECTED))
def test_every_readme_topology_has_a_layout_that_divides_the_batch(gpus, mode):
    lay = _layout(_cfg(), gpus, mode)
    assert (lay.trainer_processes, lay.vllm_gpus, lay.episodes_per_process, lay.accumulation) == EXPECTED[gpus, mode]
    assert lay.trainer_processes * lay.episodes_per_process == 64 and lay.micro_batch == 4
    assert lay.zero3 == (lay.trainer_processes > 1)  # launchers/accelerate/zero3.yaml
    assert lay.max_model_len == 8192 + 8192 + 1024  # prompt + completion + one turn
    assert any("GiB" in m for m in lay.memory)  # the memory plan was made, not skipped


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_the_cli_prints_a_plan_for_every_readme_gpu_count(gpus, mode, capsys):
    code = gpu_job.main(["--gpus", str(gpus), "--mode", mode, "--job-dir", "/tmp/j", *SEEDS[:2]])
    out, err = capsys.readouterr()
    if gpus == 1 and mode == "server":  # the one refusal: a server needs a GPU of its own
        assert code == 2 and "train.vllm_mode=colocate" in err
        return
    assert code == 0, err
    assert out.startswith(f"# plan: {gpus} GPU(s), {mode}")
    launch = "python -m musique_rl" if (gpus, mode) == (1, "colocate") else "accelerate launch"
    assert launch in out and f"train.vllm_mode={mode}" in out
    assert ("serve Qwen/Qwen2.5-7B-Instruct" in out) == (mode == "server")


def test_a_batch_no_process_count_divides_fails_before_loading_with_the_nearest_settings():
    with pytest.raises(gpu_job.TopologyError, match=r"(?s)3 GPU.*colocate.*8 x 8 = 64.*3 trainer processes.*"
                       r"train.prompts_per_step=6.*train.prompts_per_step=9.*1 / 2 / 4 / 8 trainer processes"):
        _layout(_cfg(), 3, "colocate")
    # 3 trainer processes, as the researcher ran them, with 6 prompts: vLLM on the fourth GPU
    lay = _layout(_cfg("train.prompts_per_step=6", "train.micro_batch_size=4"), 4, "server")
    assert (lay.trainer_processes, lay.vllm_gpus, lay.micro_batch, lay.accumulation) == (3, 1, 4, 4)
    with pytest.raises(gpu_job.TopologyError, match="train.micro_batch_size=3: .*divide the 16 episodes.*"
                       "train.micro_batch_size=2"):
        _layout(_cfg("train.micro_batch_size=3", "train.num_generations=4"), 2, "colocate")


def test_colocate_memory_is_checked_and_the_fix_named():
    # micro-batch 8 at the original researcher's budgets: ~92 GiB of training peak beside vLLM's 0.3 of the card
    with pytest.raises(gpu_job.TopologyError, match=r"colocate memory: vLLM's share 23.8 GiB.*> the 79.2 GiB card. "
                       r"Nearest valid: train.micro_batch_size=4"):
        _layout(_cfg("train.micro_batch_size=8"), 1, "colocate")
    with pytest.raises(gpu_job.TopologyError, match=r"vllm_gpu_memory_utilization=0.1 gives vLLM 7.9 GiB.*>=0.2"):
        _layout(_cfg("train.vllm_gpu_memory_utilization=0.1"), 1, "colocate")
    # a 64 GiB card: the default micro-batch of 4 does not fit beside vLLM, 2 does
    with pytest.raises(gpu_job.TopologyError, match="Nearest valid: train.micro_batch_size=2$"):
        _layout(_cfg(), 1, "colocate", card=64)
    assert _layout(_cfg(), 1, "colocate", card=None).memory == []  # card unknown: said, not guessed
    assert any("memory not checked" in n for n in _layout(_cfg(), 1, "colocate", card=None).notes)


def test_the_server_context_fits_every_request_a_turn_sends(tmp_path):
    cfg = _cfg()
    with pytest.raises(gpu_job.TopologyError, match="gpu.vllm_max_model_len=12288 is below .* 17408"):
        gpu_job.layout(_cfg("gpu.vllm_max_model_len=12288"), 2, "server", card_gib=H100,
                       accelerate_config=tmp_path / "none.yaml")
    topo = gpu_job.plan(cfg, gpus=["0", "1"], job_dir=tmp_path, overrides=[], env={}, card_gib=H100)
    assert topo.server_cmd[topo.server_cmd.index("--max-model-len") + 1] == "17408"
    with pytest.raises(gpu_job.TopologyError, match="exceeds the model's 32768 positions"):
        _layout(_cfg("env.max_prompt_tokens=30000"), 2, "server")


def test_a_longest_turn_request_never_exceeds_the_context():
    """What the server sees from a rollout: one max_tokens per turn (the largest live budget) for
    every context; the longest context plus it stays within trainer.vllm_context_length."""
    from musique_rl.core.trainer import vllm_context_length

    cfg = _cfg()
    env = cfg.env
    per_turn, budget, prompt = int(env.max_tokens_per_turn), int(env.max_completion_tokens), int(env.max_prompt_tokens)
    used = [0, budget - 1, budget - per_turn, 5000]  # completion tokens so far of four live episodes
    limits = [min(per_turn, budget - u) for u in used]
    assert max(prompt + u for u in used) + max(limits) <= vllm_context_length(cfg.env)
    assert prompt + budget - 1 + max(limits) > prompt + budget  # the old context length was too short


def test_wants_topology_launches_colocate_processes_for_one_process_seeing_several_gpus():
    cfg = _cfg("train.vllm_mode=colocate")
    assert gpu_job.wants_topology(cfg, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert not gpu_job.wants_topology(cfg, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert not gpu_job.wants_topology(cfg, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "WORLD_SIZE": "4"})
    assert not gpu_job.wants_topology(cfg, env={"CUDA_VISIBLE_DEVICES": "0,1", gpu_job.ROLE_ENV: "trainer"})


def test_preflight_refuses_a_batch_the_launched_processes_cannot_split():
    with pytest.raises(ValueError, match="over 3 trainer processes.*train.prompts_per_step=6"):
        gpu_job.preflight(_cfg("train.backend=hf", "model=tiny"), 3)


def test_preflight_checks_colocate_memory_on_the_card_it_runs_on(monkeypatch):
    """A colocate job launched by hand: each process checks its own card before loading."""
    monkeypatch.setattr(gpu_job, "card_gib", lambda: 64.0)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", raising=False)
    cfg = _cfg("train.vllm_mode=colocate")
    with pytest.raises(gpu_job.TopologyError, match="Nearest valid: train.micro_batch_size=2$"):
        gpu_job.preflight(cfg, 1)
    gpu_job.preflight(_cfg("train.vllm_mode=colocate", "train.micro_batch_size=2"), 1)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")  # 4 ZeRO-3 processes: a quarter of the weights each
    gpu_job.preflight(cfg, 4)
