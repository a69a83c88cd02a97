# One image for every duplexbus service; the command picks the role.
FROM python:3.11-slim

WORKDIR /app
# The CPU build of torch (PyPI's default torch wheel carries gigabytes of CUDA libraries).
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY duplexbus ./duplexbus
COPY shared ./shared
COPY services ./services
COPY models ./models
COPY clients ./clients
RUN pip install --no-cache-dir '.[models]'

ENV PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["duplexbus", "frontend", "--host", "0.0.0.0", "--port", "8000"]
