//! A call's fence (issue 30, 2): which attempt may speak for the call. Every attempt is a key
//! under its worker's lease; the revision the key was written at is the attempt's fence, and
//! only what carries it is accepted. An attempt taken over from a coordinator that went away
//! also carries the fence it was started with. The dispatcher asks this type, and tells it
//! when a key is written, an attempt adopted, or an attempt ended; nothing else sets a fence.

use crate::lease::Revision;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fence {
    /// The revision of the current attempt's key; `None` until it is written (the
    /// assignment is sent only then).
    written: Option<Revision>,
    /// An attempt taken over from a coordinator that went away: the fence it was started
    /// with (its outcome carries that one), and no assignment is sent for it.
    adopted: Option<Revision>,
}

impl Fence {
    /// A new attempt whose key is not written yet: nothing it says counts yet.
    pub(super) fn unwritten(&mut self) {
        self.written = None;
    }

    /// The current attempt's key was written at `revision`.
    pub(super) fn written_at(&mut self, revision: Revision) {
        self.written = Some(revision);
    }

    /// The current attempt was started by a coordinator that went away, with `fence`; its
    /// key here is written next.
    pub(super) fn adopt(&mut self, fence: Revision) {
        self.written = None;
        self.adopted = Some(fence);
    }

    /// The revision of the current attempt's key, once written.
    pub(super) fn written(&self) -> Option<Revision> {
        self.written
    }

    pub(super) fn is_written(&self) -> bool {
        self.written.is_some()
    }

    /// The current attempt was adopted (it runs already: no assignment is sent for it).
    pub(super) fn is_adopted(&self) -> bool {
        self.adopted.is_some()
    }

    /// Whether what carries `fence` speaks for the current attempt.
    pub(super) fn accepts(&self, fence: Revision) -> bool {
        self.written == Some(fence) || self.adopted == Some(fence)
    }

    /// The current attempt ended: no fence is current; whether its key had been written (and
    /// so is there to take away).
    pub(super) fn end(&mut self) -> bool {
        let written = self.written.take().is_some();
        self.adopted = None;
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_current_attempt_s_fences_are_accepted_and_an_ended_one_accepts_nothing() {
        let mut f = Fence::default();
        assert!(!f.accepts(0) && !f.is_written());
        f.written_at(7);
        assert!(f.accepts(7) && !f.accepts(6) && !f.accepts(8));
        assert!(f.end(), "its key was written");
        assert!(!f.accepts(7));
        assert!(!f.end(), "nothing to take away twice");
        // Adopted: the fence it was started with, and then its key here.
        f.adopt(3);
        assert!(f.is_adopted() && f.accepts(3) && !f.is_written());
        f.written_at(9);
        assert!(f.accepts(3) && f.accepts(9) && !f.accepts(4));
        assert_eq!(f.written(), Some(9));
        f.end();
        assert!(!f.is_adopted() && !f.accepts(3) && !f.accepts(9));
        // A new attempt: unwritten until its key is.
        f.written_at(11);
        f.unwritten();
        assert!(!f.accepts(11) && f.written().is_none());
    }
}
