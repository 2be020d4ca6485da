"""One job, from a composed config to its result: ``app.run`` checks the config, owns the run dir
(``launch``), opens the tracker and hands it to the work (``train`` or ``evaluate``), which returns a
``result.JobResult``; then the doctor, and the result line (``console`` prints the steps between)."""
