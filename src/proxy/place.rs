//! Placement of one attempt: the policy's choice among the replicas not
//! yet tried (a Responses API id's holder only), confirmed a member by
//! Pingora's selection (a replica removed by a reload since is passed over);
//! the peer it is sent to; and the answer when no replica is left.

use std::net::SocketAddr;
use std::sync::Arc;

use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};

use super::{Ctx, Router};
use crate::balancer::addr_key;
use crate::errors::RouterError;
use crate::policy::{Decision, Reason, ReplicaId, Shape};
use crate::replicas::{Replica, Replicas, View};

impl Router {
    /// The replica for this attempt, the decision that chose it and whether
    /// it was chosen in panic mode; `None` when no replica is left. Replicas
    /// Pingora no longer counts as members are added to `ctx.tried` and
    /// passed over.
    pub(super) fn choose(
        &self,
        ctx: &mut Ctx,
        list: &View,
        holder: Option<ReplicaId>,
    ) -> Option<(Arc<Replica>, Decision, bool)> {
        // The holder is offered whatever `model` says: the engine answers.
        let model = ctx.model.as_deref().filter(|_| holder.is_none());
        for _ in 0..=list.len() {
            // Only a response's holder is offered; other requests exclude
            // just the replicas tried (no copy of the list on that path).
            let others: Vec<ReplicaId>;
            let excluded = match holder {
                Some(h) => {
                    others = (ctx.tried.iter().copied())
                        .chain(list.iter().map(|r| r.id).filter(|id| *id != h))
                        .collect();
                    &others
                }
                None => &ctx.tried,
            };
            let (states, panic) = Replicas::states(list, excluded, model);
            let mut decision = match ctx.request() {
                Some(r) => self.policy.place(r, &states),
                None => self.policy.spread(&states),
            };
            if holder.is_some() && decision.replica.is_some() {
                decision.reason = Reason::Key;
                decision.shape = Shape::Continuation;
            }
            let replica = decision
                .replica
                .and_then(|id| list.iter().find(|r| r.id == id))?;
            // Pingora's own view: still a member (not removed by reload).
            if self
                .balancer
                .select_with(&addr_key(&replica.addr), 1, |_, _| true)
                .is_none()
            {
                ctx.tried.push(replica.id);
                continue;
            }
            return Some((Arc::clone(replica), decision, panic));
        }
        None
    }

    /// The peer for a replica at `addr`, with the settings in force.
    pub(super) fn peer(&self, addr: &SocketAddr) -> HttpPeer {
        let s = self.settings.load();
        let tls = &s.tls;
        let mut peer = HttpPeer::new(*addr, tls.enabled, tls.sni.clone());
        let o = &mut peer.options;
        o.verify_cert = tls.verify;
        o.verify_hostname = tls.verify_hostname();
        o.connection_timeout = Some(s.connect_timeout);
        o.total_connection_timeout = Some(s.connect_timeout);
        o.read_timeout = Some(s.read_timeout);
        o.write_timeout = Some(s.write_timeout);
        o.idle_timeout = Some(s.idle_timeout);
        peer
    }

    /// The error when no replica could be chosen: the response's holder is
    /// down (`held`), or no replica is live.
    pub(super) fn unplaced(&self, ctx: &mut Ctx, held: bool) -> Result<Box<HttpPeer>> {
        if let (Some((id, Some(_))), true) = (&ctx.response, held) {
            ctx.error = Some(RouterError::ResponseUnavailable {
                id: id.chars().take(crate::response_ids::MAX_ID).collect(),
            });
            return Error::e_explain(ErrorType::HTTPStatus(503), "response's replica down");
        }
        self.metrics.no_replica.inc();
        ctx.error = Some(RouterError::NoReplica);
        Error::e_explain(ErrorType::HTTPStatus(503), "no live replica")
    }
}
