from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from . import db


class User(db.Model):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    welcomed: Mapped[bool] = mapped_column(default=False)
