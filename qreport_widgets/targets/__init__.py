"""Targets: where a quantized model runs and the file that carries it there.

``llamacpp/``: llama.cpp. A Hugging Face decoder (its float weights, or int4 / int8 values chosen by
the eager engine) written as a GGUF file tensor by tensor in llama.cpp's block formats (``Q4_0``,
``Q4_1``, ``Q8_0``, ``F16``, ``F32``), and that file loaded and run by llama.cpp itself in a worker
process (logits, perplexity, tokens per second), plus llama.cpp's own quantization for comparison.

A target knows nothing of sessions, engines or widgets: it is given a model (or a file) and returns
bytes, files and measurements.

May import: ``qreport_widgets.core``, ``qreport_widgets.errors``. Nothing else of the package.
"""
