"""Stands in for a mail API."""


def send_mail(sender: str, to: str, subject: str) -> None:
    print(f"{sender} sends {subject!r} to {to}", flush=True)
