"""Train the demo models the tests load into this folder (tests/conftest.py copies them into each
run's weights folder): run it after changing a model, its training or its data, once the old files
are removed. About a minute and a half on two cores.

    python tests/weights/refresh.py
"""

from pathlib import Path

from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.demo.text import trained_text_decoder

HERE = Path(__file__).parent
KEPT = ("cnn", "mixer", "prelu", "prelu_chain", "bert")  # the MobileNet trains for `make test-slow` only

if __name__ == "__main__":
    for name in KEPT:
        trained_digits_model(name, HERE)
    trained_text_decoder(cache_dir=HERE)
    for lock in HERE.glob("*.lock"):
        lock.unlink()
