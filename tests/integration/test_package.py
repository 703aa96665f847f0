"""``import comera_rec`` stays free of TorchRec; integration names load on first use."""

import subprocess
import sys


def test_lazy_integration_export() -> None:
    code = (
        "import sys, comera_rec\n"
        "assert 'torchrec' not in sys.modules\n"
        "assert comera_rec.compress is comera_rec.integration.compress\n"
        "assert comera_rec.TTMEmbeddingBagCollection.__name__ == 'TTMEmbeddingBagCollection'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
