# megatron-adacc on NVIDIA's PyTorch container: Megatron-LM at the pinned commit with patches/ applied, and
# megatron-adacc with its CUDA kernels for V100, A100 and H100 (sm_70, sm_80, sm_90).
#
#   docker build -t megatron-adacc .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it megatron-adacc \
#       scripts/megatron_lm_train.sh gpt-345m adacc-auto
#
# The base must ship a CUDA 12.x toolkit: CUDA 13 no longer compiles for sm_70 (V100). Releases 25.06 and
# older of the NGC PyTorch container are CUDA 12.x and include apex and Transformer Engine, which PyPI must
# never provide. For A100/H100 only, a CUDA 13 base works with --build-arg CUDA_ARCHS="8.0;9.0".
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_REPO=https://github.com/NVIDIA/Megatron-LM.git
# The pinned commit: the first line of patches/supported-commits.txt (a test keeps the two equal).
ARG MEGATRON_COMMIT=d98e8a64ddf34856e74b24714e3bedb2f5a39553
ARG CUDA_ARCHS="7.0;8.0;9.0"

ENV MEGATRON_DIR=/opt/megatron-lm \
    ADACC_DIR=/opt/megatron-adacc \
    TORCH_CUDA_ARCH_LIST=${CUDA_ARCHS} \
    ADACC_BUILD_CUDA=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Megatron-LM at exactly the pinned commit (a shallow fetch of one commit; no branch can move under us).
RUN git init -q "${MEGATRON_DIR}" \
    && git -C "${MEGATRON_DIR}" remote add origin "${MEGATRON_REPO}" \
    && git -C "${MEGATRON_DIR}" fetch -q --depth 1 origin "${MEGATRON_COMMIT}" \
    && git -C "${MEGATRON_DIR}" checkout -q --detach FETCH_HEAD \
    && test "$(git -C "${MEGATRON_DIR}" rev-parse HEAD)" = "${MEGATRON_COMMIT}"

# Our patch set, applied by the same script users run (it checks the commit and dry-runs first). The patched
# checkout is then the megatron-core distribution megatron-adacc depends on (megatron-core 0.20 dev);
# --no-deps keeps the container's torch, apex and TE (pinned by /etc/pip/constraint.txt) untouched.
COPY patches/ ${ADACC_DIR}/patches/
COPY scripts/apply_patches.sh ${ADACC_DIR}/scripts/apply_patches.sh
RUN bash "${ADACC_DIR}/scripts/apply_patches.sh" "${MEGATRON_DIR}" \
    && pip install --no-cache-dir --no-deps -e "${MEGATRON_DIR}"

# megatron-adacc with its compiled extension. There is no GPU during `docker build`: ADACC_BUILD_CUDA=1 and
# TORCH_CUDA_ARCH_LIST make the build compile the CUDA kernels for every listed architecture anyway.
COPY . ${ADACC_DIR}
WORKDIR ${ADACC_DIR}
RUN pip install --no-cache-dir "pulp>=2.8" "highspy>=1.8" \
    && MAX_JOBS="$(nproc)" pip install --no-cache-dir --no-build-isolation --no-deps -e "${ADACC_DIR}"

# Build-time checks: the patched entry point imports our package, and every requested architecture is in
# the compiled extension (the arch check CI's compile check runs: cuobjdump lists one ELF per sm_XX).
RUN grep -q "import megatron_adacc.megatron_lm" "${MEGATRON_DIR}/pretrain_gpt.py" \
    && python -c "import megatron_adacc.megatron_lm, megatron.core; print('megatron-core', megatron.core.__version__)" \
    && python -c "from megatron_adacc.adacc.policy.strategies.base import select_backend as s; print('MILP solver', s())" \
    && mapfile -t so < <(python -c 'import glob, megatron_adacc, os; print("\n".join(glob.glob(os.path.join(os.path.dirname(megatron_adacc.__file__), "**", "_C*.so"), recursive=True)))') \
    && [[ -n "${so[0]:-}" ]] \
    && scripts/check_cuda_arches.sh "${CUDA_ARCHS}" "${so[@]}"

ENV PATH="${ADACC_DIR}/scripts:${PATH}"
CMD ["bash"]
