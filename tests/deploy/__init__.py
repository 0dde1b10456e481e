"""The deployment artefacts: Kubernetes manifests, rendered and validated; the Containerfile."""
