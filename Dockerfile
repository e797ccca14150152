# The threadlog worker image used by docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY threadlog ./threadlog
COPY broker ./broker
COPY schemas ./schemas
COPY producers ./producers
COPY processors ./processors
COPY projections ./projections
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["threadlog", "worker", "--help"]
