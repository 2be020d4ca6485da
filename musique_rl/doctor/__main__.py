"""``python -m musique_rl.doctor``: the doctor's command line (doctor/cli.py)."""

from musique_rl.doctor.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
