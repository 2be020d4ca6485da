"""Per-step instruments for every hypothesis (h01..h08, preflight) and the doctor that reads them.

One module per concern: advantages (h01), ledger (h02), kl (h03), truncation (h04), reward_signal
(h05), sync (h06), episodes (h07), updates (h08), preflight; `Instruments` glues them for the
trainer, `callback.InstrumentsCallback` measures optimizer steps, `doctor` turns a run's metrics
into a ranked diagnosis.
"""

from musique_rl.diagnostics.instruments import Instruments
from musique_rl.diagnostics.ledger import Source

__all__ = ["Instruments", "Source"]
