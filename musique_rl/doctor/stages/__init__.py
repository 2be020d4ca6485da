"""The doctor's rules, one module per stage of the GRPO step (doctor/step.py).

Importing this package imports every module in it, in name order, which registers their rules
(``@rule``, doctor/findings.py): a new module here is all a new check takes. The doctor
(doctor/diagnose.py) imports it, then doctor/reward_power.py, whose flat-reward rules judge the
others' findings; the rules run in the order they register. Each rule declares the stage its
findings sit in, whatever it reads: this project's instruments, the tier-3 invariants, the field
alarms, or TRL's own metric names (for plain TRL logs; their shared helpers are in
doctor/trl_rules.py). A rule declared in another stage's module says why in its docstring.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
