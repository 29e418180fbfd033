"""The gateway: ``app.py`` wires every route; each protocol has its folder (``speech``, ``realtime``, ``webrtc``,
``video``, ``video_chat``, ``robot``), ``security`` says who may use the server, ``ops`` runs it (metrics, logs,
drain) and ``cli`` starts it. The modules beside ``app.py`` are what the routes share: settings, the process state,
error shapes, the listening socket and the reader/writer task pair."""
