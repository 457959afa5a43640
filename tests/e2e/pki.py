"""The end-to-end cluster's credentials, made fresh for each cluster with the openssl command:
a CA, the API server's serving certificate, the service-account signing key, and one bearer
token per client (an admin for the tests, kubelet as its node, the scheduler, the controller
manager) written to the API server's static token file.

Owns: the files under DIR/pki and the kubeconfigs. Must not start anything.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


class PkiError(Exception):
    """openssl is missing or failed; the message has its output."""


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise PkiError("the openssl command is needed for the cluster's certificates")
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args)}: {proc.stderr.strip()}")


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...]
    token: str


@dataclass
class Pki:
    """The files of one cluster's credentials under `directory`."""

    directory: str
    users: dict[str, User]

    @property
    def ca(self) -> str:
        return os.path.join(self.directory, "ca.crt")

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def kubeconfig(self, user: str, server: str) -> str:
        """A kubeconfig for `user` at `server`, written beside the certificates; its path."""
        path = self.path(f"{user}.kubeconfig")
        with open(path, "w") as f:
            f.write(
                "apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: e2e\n  cluster:\n    server: {server}\n"
                f"    certificate-authority: {self.ca}\n"
                f"users:\n- name: {user}\n  user:\n    token: {self.users[user].token}\n"
                f"contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {user}\n"
                "current-context: e2e\n")
        os.chmod(path, 0o600)
        return path


def client_certificate(pki: Pki, name: str, server: str, groups: tuple[str, ...] = ()) -> str:
    """A client certificate for user `name` (CN) in `groups` (O), signed by the cluster's CA
    (the API server's --client-ca-file), and a kubeconfig naming it by path as the kubelet's
    own does; the kubeconfig's path."""
    key, crt = pki.path(f"{name}.key"), pki.path(f"{name}.crt")
    subject = f"/CN={name}" + "".join(f"/O={g}" for g in groups)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj", subject,
             "-CA", pki.ca, "-CAkey", pki.path("ca.key"),
             "-addext", "basicConstraints=critical,CA:FALSE",
             "-addext", "extendedKeyUsage=clientAuth", "-keyout", key, "-out", crt)
    path = pki.path(f"{name}.kubeconfig")
    with open(path, "w") as f:
        f.write("apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: e2e\n  cluster:\n    server: {server}\n"
                f"    certificate-authority: {pki.ca}\n"
                f"users:\n- name: {name}\n  user:\n    client-certificate: {crt}\n"
                f"    client-key: {key}\n"
                f"contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {name}\n"
                "current-context: e2e\n")
    os.chmod(path, 0o600)
    return path


def make(directory: str, node: str, addresses: list[str]) -> Pki:
    """Write the CA, the API server's certificate (for `addresses` and localhost), the
    service-account key pair and the token file; the users are `admin`, `kubelet` (the node
    `node`), `scheduler` and `controller-manager`."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    pki = Pki(directory, {
        "admin": User("e2e-admin", ("system:masters",), secrets.token_hex(16)),
        "kubelet": User(f"system:node:{node}", ("system:nodes",), secrets.token_hex(16)),
        "scheduler": User("system:kube-scheduler", (), secrets.token_hex(16)),
        "controller-manager": User("system:kube-controller-manager", (), secrets.token_hex(16)),
    })
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7",
             "-subj", "/CN=gpu-agent-e2e-ca", "-keyout", pki.path("ca.key"), "-out", pki.ca)
    sans = ",".join(["DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
                     "DNS:kubernetes.default.svc", *(f"IP:{a}" for a in addresses)])
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7",
             "-subj", "/CN=kube-apiserver", "-CA", pki.ca, "-CAkey", pki.path("ca.key"),
             "-addext", f"subjectAltName={sans}", "-addext", "basicConstraints=critical,CA:FALSE",
             "-addext", "extendedKeyUsage=serverAuth",
             "-keyout", pki.path("apiserver.key"), "-out", pki.path("apiserver.crt"))
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", pki.path("sa.key"))
    _openssl("pkey", "-in", pki.path("sa.key"), "-pubout", "-out", pki.path("sa.pub"))
    with open(pki.path("tokens.csv"), "w") as f:
        for i, user in enumerate(pki.users.values()):
            groups = ",".join(user.groups)
            f.write(f'{user.token},{user.name},uid-{i}' + (f',"{groups}"' if groups else "") + "\n")
    os.chmod(pki.path("tokens.csv"), 0o600)
    return pki
