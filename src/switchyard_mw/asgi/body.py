"""Where the body reader was (now `switchyard_mw.request_body`): its names import from here."""

from ..request_body import ClientDisconnected as ClientDisconnected
from ..request_body import read_body as read_body
