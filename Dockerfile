# Development container: NVIDIA's PyTorch image (PyTorch, Triton, CUDA, Nsight)
# plus the few Python packages in requirements.txt.
#   docker build -t kernel-dev-ft .
#   docker run -it --rm --gpus all --ipc host -e HF_TOKEN=$HF_TOKEN \
#     -v "$(pwd)":/workspace -v ~/.cache/huggingface:/root/.cache/huggingface \
#     -w /workspace kernel-dev-ft
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace
COPY requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt
# Optional: the benchmark's third-party peers (their rows say "not installed" otherwise).
# RUN pip install --no-cache-dir liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# (requirements-cpu.txt / requirements-gpu.txt are for machines without this image.)

# The sources are mounted at /workspace by `docker run -v`, not copied in, so
# edits on the host are live inside the container.
CMD ["bash"]
