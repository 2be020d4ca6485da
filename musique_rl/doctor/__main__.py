"""``python -m musique_rl.doctor``: the doctor's command line (doctor/diagnose.py)."""

from musique_rl.doctor.diagnose import main

if __name__ == "__main__":
    raise SystemExit(main())
